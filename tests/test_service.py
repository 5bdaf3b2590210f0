"""`meshnode service`: the systemd user unit and the launchd agent it writes.

The renderers are pure and checked on any platform; install/uninstall/status run through
:func:`meshnode.cli.main` with ``XDG_CONFIG_HOME`` and ``HOME`` in a temporary folder and
no service manager on ``PATH``, so the real user's systemd is never touched. The slow
tests hand the unit to ``systemd-analyze verify`` and ask the real ``systemctl``.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess

import pytest

from meshnode.cli import service


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A home of its own and no systemctl/launchctl: nothing reaches the real service manager."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return tmp_path


def _unit(meshnode_main, *args):
    r = meshnode_main("service", "install", "--dry-run", "--kind", "systemd", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_systemd_unit_runs_serve_headless_in_the_foreground_and_restarts_on_failure(sandbox, meshnode_main):
    text = _unit(meshnode_main, "--no-model", "--max-memory", "6GB", "--interface", "10.0.0.1",
                 "--interface", "10.0.0.2", "--name", "my laptop", "--port", "0")
    assert text.startswith(f"# {sandbox / 'xdg' / 'systemd' / 'user' / 'meshnode.service'}\n")
    exec_start = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    assert " -m meshnode serve --headless " in exec_start
    # what the user typed, not the parsed values
    assert "--max-memory 6GB" in exec_start and "--interface 10.0.0.1 --interface 10.0.0.2" in exec_start
    assert '--name "my laptop"' in exec_start and "--no-model" in exec_start and "--port 0" in exec_start
    assert "Type=exec" in text and "Restart=on-failure" in text and "RestartPreventExitStatus=2" in text
    assert "StandardError=journal" in text and "WantedBy=default.target" in text
    assert not (sandbox / "xdg").exists()          # --dry-run writes nothing


def test_systemd_quoting_keeps_specifiers_and_variables_literal():
    assert service._systemd_quote("a%b$c") == "a%%b$$c"
    assert service._systemd_quote('say "hi" \\') == '"say \\"hi\\" \\\\"'
    with pytest.raises(service.ServiceError):
        service._systemd_quote("two\nlines")


def test_paths_in_the_unit_are_absolute(sandbox, meshnode_main, monkeypatch):
    (sandbox / "m.gguf").write_bytes(b"")
    monkeypatch.chdir(sandbox)
    text = _unit(meshnode_main, "--home", "nodehome", "--model", "m.gguf")
    assert f"--home {sandbox / 'nodehome'}" in text and f"--model {sandbox / 'm.gguf'}" in text


def test_launchd_agent_runs_serve_headless_and_logs_under_library_logs(sandbox, meshnode_main):
    r = meshnode_main("service", "install", "--dry-run", "--kind", "launchd", "--no-model")
    assert r.returncode == 0, r.stderr
    header, body = r.stdout.split("\n", 1)
    assert header == f"# {sandbox / 'home' / 'Library' / 'LaunchAgents' / 'io.meshnode.node.plist'}"
    plist = plistlib.loads(body.encode())
    assert plist["Label"] == "io.meshnode.node"
    assert plist["ProgramArguments"][-3:] == ["serve", "--headless", "--no-model"]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    log = str(sandbox / "home" / "Library" / "Logs" / "meshnode" / "meshnode.log")
    assert plist["StandardErrorPath"] == log == plist["StandardOutPath"]


def test_the_frozen_app_runs_itself():
    assert service.program(frozen=True) == [service.sys.executable]
    assert service.program(frozen=False)[1:] == ["-m", "meshnode"]


def test_api_key_is_refused_so_it_stays_out_of_the_unit_file(sandbox, meshnode_main):
    r = meshnode_main("service", "install", "--dry-run", "--api-key", "secret")
    assert r.returncode == 2 and "config.toml" in r.stderr and "secret" not in r.stdout
    assert "Traceback" not in r.stderr


def test_a_bad_serve_option_is_refused_by_the_parser(sandbox, meshnode_main):
    r = meshnode_main("service", "install", "--dry-run", "--max-memory", "lots")
    assert r.returncode == 2 and "argument --max-memory" in r.stderr and "Traceback" not in r.stderr


def test_install_status_uninstall_without_a_service_manager(sandbox, meshnode_main):
    unit = sandbox / "xdg" / "systemd" / "user" / "meshnode.service"
    r = meshnode_main("service", "status", "--kind", "systemd")
    assert r.returncode == 3 and "installed: no" in r.stdout

    r = meshnode_main("service", "install", "--kind", "systemd", "--no-start", "--no-model")
    assert r.returncode == 0 and unit.is_file() and "systemctl --user" in r.stdout
    assert "serve --headless --no-model" in unit.read_text()

    r = meshnode_main("service", "status", "--kind", "systemd")
    assert r.returncode == 3
    assert f"installed: {unit}" in r.stdout and "state: unknown: systemctl is not installed" in r.stdout

    # starting needs systemctl: one clear line saying the file is there and what to run
    r = meshnode_main("service", "install", "--kind", "systemd", "--no-model")
    assert r.returncode == 2 and "systemctl --user daemon-reload" in r.stderr and "not found" in r.stderr

    r = meshnode_main("service", "uninstall", "--kind", "systemd")
    assert r.returncode == 0 and not unit.exists()
    r = meshnode_main("service", "uninstall", "--kind", "systemd")
    assert r.returncode == 0 and "no service installed" in r.stdout


def test_unsupported_platform_is_one_line():
    assert service.default_kind("win32") is None
    assert service.default_kind("linux") == "systemd" and service.default_kind("darwin") == "launchd"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    command = service.program() + ["serve", "--headless", "--name", "my laptop", "--max-memory", "6GB"]
    unit = tmp_path / "meshnode.service"
    unit.write_text(service.render_systemd(command))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    r = subprocess.run(["systemd-analyze", "--user", "verify", str(unit)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    # and it does catch a broken unit
    unit.write_text(service.render_systemd(["/nonexistent/meshnode"]) + "Bogus=1\n")
    r = subprocess.run(["systemd-analyze", "--user", "verify", str(unit)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 or r.stderr.strip()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("systemctl") is None, reason="systemctl is not installed")
def test_status_asks_the_real_systemctl(tmp_path, monkeypatch):
    # only reads: `systemctl --user is-active`; the unit lives in a temporary XDG_CONFIG_HOME
    from nodeproc import meshnode_cmd

    env_home = tmp_path / "xdg" / "systemd" / "user"
    env_home.mkdir(parents=True)
    (env_home / "meshnode.service").write_text(service.render_systemd(service.program()))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    r = meshnode_cmd("service", "status", "--kind", "systemd")
    assert r.returncode in (0, 3) and "Traceback" not in r.stderr
    state = next(ln for ln in r.stdout.splitlines() if ln.startswith("state: "))
    assert state.split(": ", 1)[1]           # "inactive", or "unknown: ..." with systemctl's reason
