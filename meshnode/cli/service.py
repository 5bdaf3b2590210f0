"""`meshnode service install | uninstall | status [serve options]`: start the node at login.

Linux gets a systemd *user* unit (``$XDG_CONFIG_HOME/systemd/user/meshnode.service``)
whose stderr goes to the journal (``journalctl --user -u meshnode``); macOS gets a
launchd agent (``~/Library/LaunchAgents/io.meshnode.node.plist``) logging to
``~/Library/Logs/meshnode/meshnode.log``. Both run ``meshnode serve --headless`` with the
serve options given here, in the foreground (the service manager supervises it; the node
never daemonises itself), restart it when it fails, and leave it stopped after a clean
exit or a user error (exit 2: a bad option or config.toml would only fail again).

The renderers are pure functions of the command line, so tests render both kinds on any
platform; ``--dry-run`` prints the file instead of writing it and ``--no-start`` writes it
without asking the service manager to start it.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from meshnode.cli import add_common_options
from meshnode.errors import MeshnodeError

SYSTEMD_UNIT = "meshnode.service"
LAUNCHD_LABEL = "io.meshnode.node"
KINDS = ("systemd", "launchd")
# What a user's mistake exits with (MeshnodeError.exit_code, argparse): restarting would
# only fail the same way, so the service manager leaves the node stopped.
USER_ERROR_EXIT = 2
RESTART_DELAY_S = 5


class ServiceError(MeshnodeError):
    """The service cannot be installed, removed or queried as asked."""


# ---- the serve options, kept as the user typed them ------------------------------------


def _keep_raw(convert):
    """An argparse ``type`` that checks the text with ``convert`` but keeps the text, so
    the unit holds what the user typed (``6GB``, not 6000000000)."""
    def check(text: str) -> str:
        convert(text)
        return text
    check.__name__ = getattr(convert, "__name__", "value")   # argparse's error names it
    return check


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """``meshnode serve``'s options, checked as serve checks them; absent ones stay absent."""
    from meshnode.cli.run import _add_node_options

    before = len(p._actions)
    _add_node_options(p)       # also --home and --log-level, which keep their defaults
    for action in p._actions[before:]:
        if action.option_strings and action.dest not in ("help", "home", "log_level"):
            action.default = argparse.SUPPRESS
            if action.type is not None:
                action.type = _keep_raw(action.type)


def serve_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The ``serve --headless`` arguments the service runs, rebuilt from the options given.

    Paths are made absolute (the service does not start in this directory); ``--api-key``
    is refused (it would sit in the unit file and in ``ps``)."""
    out = ["serve", "--headless"]
    if getattr(args, "api_key", None) is not None:
        raise ServiceError("--api-key would be written into the service file and shown by ps: "
                           "put it in config.toml's [http] api_key (docs/config.md) instead")
    home = args.home or os.environ.get("MESHNODE_HOME")
    if home:
        out += ["--home", str(Path(home).expanduser().resolve())]
    if args.log_level:
        out += ["--log-level", args.log_level]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "home", "log_level", "dry_run",
                                                        "no_start", "kind"):
            continue
        if not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]        # the long spelling
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value or ():
                out += [flag, str(v)]
        elif value is not None:
            if action.dest in ("model", "draft_model") and Path(value).expanduser().exists():
                value = str(Path(value).expanduser().resolve())
            out += [flag, str(value)]
    return out


def program(frozen: bool | None = None) -> list[str]:
    """How the service starts meshnode: this interpreter (so a uv tool or pipx venv keeps
    its own packages) or, in the PyInstaller app, the app itself."""
    if frozen if frozen is not None else getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "meshnode"]


# ---- renderers (pure) ------------------------------------------------------------------


def _systemd_quote(arg: str) -> str:
    """One ExecStart word: specifiers (%) and variables ($) taken literally, quoted when
    it holds spaces or quotes (systemd.service(5), "Command lines")."""
    if any(c in arg for c in "\n\r\0"):
        raise ServiceError(f"an argument with a line break cannot go into a unit: {arg!r}")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_systemd(command: list[str]) -> str:
    """A systemd user unit that runs ``command`` in the foreground."""
    exec_start = " ".join(_systemd_quote(a) for a in command)
    return f"""\
# Written by `meshnode service install`; `meshnode service uninstall` removes it.
[Unit]
Description=meshnode: this machine's node of the LAN's LLM server

[Service]
Type=exec
ExecStart={exec_start}
Environment=PYTHONUNBUFFERED=1
# Logs go to the journal: journalctl --user -u meshnode
StandardOutput=journal
StandardError=journal
SyslogIdentifier=meshnode
Restart=on-failure
RestartSec={RESTART_DELAY_S}
RestartPreventExitStatus={USER_ERROR_EXIT}
# SIGTERM stops the node cleanly; give its requests time to finish.
TimeoutStopSec=30

[Install]
WantedBy=default.target
"""


def render_launchd(command: list[str], log_file: Path | str) -> str:
    """A launchd agent (plist) that runs ``command`` at login, in the foreground."""
    doc = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": list(command),
        "RunAtLoad": True,
        # restart when it exits with a failure, not after a clean stop
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S * 2,
        "ProcessType": "Background",
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
        "StandardOutPath": str(log_file),
        "StandardErrorPath": str(log_file),
    }
    return plistlib.dumps(doc).decode("utf-8")


# ---- where things go --------------------------------------------------------------------


def default_kind(platform: str | None = None) -> str | None:
    platform = platform or sys.platform
    if platform.startswith("linux"):
        return "systemd"
    if platform == "darwin":
        return "launchd"
    return None


@dataclass(frozen=True, slots=True)
class Target:
    kind: str
    path: Path          # the unit / plist
    log: str            # where its output goes, for the user


def target(kind: str, env: dict[str, str] | None = None) -> Target:
    env = dict(os.environ if env is None else env)
    home = Path(env.get("HOME") or Path.home())
    if kind == "systemd":
        config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        return Target(kind, config / "systemd" / "user" / SYSTEMD_UNIT,
                      "journalctl --user -u meshnode")
    log_dir = home / "Library" / "Logs" / "meshnode"      # platformdirs' user_log_dir on macOS
    return Target(kind, home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist",
                  str(log_dir / "meshnode.log"))


def render(kind: str, command: list[str], tgt: Target) -> str:
    return render_systemd(command) if kind == "systemd" else render_launchd(command, tgt.log)


# ---- the service manager ----------------------------------------------------------------


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a service-manager command; None when the tool is not installed."""
    if shutil.which(cmd[0]) is None:
        return None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def _launchd_domain() -> str:
    return f"gui/{os.getuid()}"


def _start(tgt: Target) -> None:
    if tgt.kind == "systemd":
        cmds = [["systemctl", "--user", "daemon-reload"],
                ["systemctl", "--user", "enable", "--now", SYSTEMD_UNIT]]
    else:
        Path(tgt.log).parent.mkdir(parents=True, exist_ok=True)
        cmds = [["launchctl", "bootstrap", _launchd_domain(), str(tgt.path)]]
    for cmd in cmds:
        r = _run(cmd)
        if r is None or r.returncode != 0:
            why = "not found" if r is None else (r.stderr.strip() or f"exit {r.returncode}")
            raise ServiceError(f"wrote {tgt.path}, but `{' '.join(cmd)}` failed ({why}); "
                               "run it yourself once the service manager is available")


def cmd_install(args: argparse.Namespace) -> int:
    kind = _kind(args)
    tgt = target(kind)
    parser = args.service_parser
    text = render(kind, program() + serve_argv(args, parser), tgt)
    if args.dry_run:
        print(f"# {tgt.path}")
        print(text, end="")
        return 0
    tgt.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tgt.path.with_name(tgt.path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(tgt.path)
    print(f"meshnode: wrote {tgt.path}")
    if args.no_start:
        print("meshnode: not started (--no-start); " + _start_hint(tgt))
        return 0
    _start(tgt)
    print(f"meshnode: the node starts now and at every login; logs: {tgt.log}")
    return 0


def _start_hint(tgt: Target) -> str:
    if tgt.kind == "systemd":
        return f"start it with: systemctl --user daemon-reload && systemctl --user enable --now {SYSTEMD_UNIT}"
    return f"start it with: launchctl bootstrap {_launchd_domain()} {tgt.path}"


def cmd_uninstall(args: argparse.Namespace) -> int:
    kind = _kind(args)
    tgt = target(kind)
    if not tgt.path.exists():
        print(f"meshnode: no service installed ({tgt.path} does not exist)")
        return 0
    if not args.no_start:
        # stopping may fail when it never ran or no user manager is reachable; the file goes anyway
        if kind == "systemd":
            _run(["systemctl", "--user", "disable", "--now", SYSTEMD_UNIT])
        else:
            _run(["launchctl", "bootout", f"{_launchd_domain()}/{LAUNCHD_LABEL}"])
    tgt.path.unlink()
    if kind == "systemd" and not args.no_start:
        _run(["systemctl", "--user", "daemon-reload"])
    print(f"meshnode: removed {tgt.path}")
    return 0


def service_state(kind: str) -> str:
    """``active``, ``inactive``, ``failed``... or a sentence saying why it is unknown."""
    if kind == "systemd":
        r = _run(["systemctl", "--user", "is-active", SYSTEMD_UNIT])
        if r is None:
            return "unknown: systemctl is not installed"
        state = r.stdout.strip()
        if state:
            return state
        return f"unknown: systemctl --user failed ({r.stderr.strip() or f'exit {r.returncode}'})"
    r = _run(["launchctl", "print", f"{_launchd_domain()}/{LAUNCHD_LABEL}"])
    if r is None:
        return "unknown: launchctl is not available"
    if r.returncode != 0:
        return "not loaded"
    for line in r.stdout.splitlines():
        if line.strip().startswith("state ="):
            return line.split("=", 1)[1].strip()
    return "loaded"


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 when installed and running, 3 otherwise (as ``systemctl is-active``)."""
    kind = _kind(args)
    tgt = target(kind)
    if not tgt.path.exists():
        print(f"installed: no ({tgt.path} does not exist; `meshnode service install` writes it)")
        return 3
    state = service_state(kind)
    print(f"installed: {tgt.path}")
    print(f"state: {state}")
    print(f"logs: {tgt.log}")
    return 0 if state in ("active", "running") else 3


def _kind(args: argparse.Namespace) -> str:
    kind = args.kind or default_kind()
    if kind is None:
        raise ServiceError(f"no service manager support on {sys.platform} "
                           "(systemd on Linux and launchd on macOS are)")
    return kind


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="start this node at login (systemd user unit, launchd agent)",
                       description="Run `meshnode serve --headless` as a service of this user: "
                       "a systemd user unit on Linux, a launchd agent on macOS.")
    add_common_options(p)
    ssub = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser, *, start_help: str) -> None:
        q.add_argument("--kind", choices=KINDS, default=None,
                       help="service manager (default: systemd on Linux, launchd on macOS)")
        q.add_argument("--no-start", action="store_true", help=start_help)

    i = ssub.add_parser("install", help="write the service (with these serve options) and start it",
                        description="Write a service that runs `meshnode serve --headless` with "
                        "the serve options given here, and start it now and at every login.")
    common(i, start_help="only write the file; do not ask the service manager to start it")
    i.add_argument("--dry-run", action="store_true", help="print the file instead of writing it")
    add_serve_options(i)
    i.set_defaults(func=cmd_install, service_parser=i)

    u = ssub.add_parser("uninstall", help="stop the service and remove its file")
    add_common_options(u)
    common(u, start_help="only remove the file; do not ask the service manager to stop it")
    u.set_defaults(func=cmd_uninstall)

    s = ssub.add_parser("status", help="say whether the service is installed and running "
                        "(exit 0 when running, 3 otherwise)")
    add_common_options(s)
    s.add_argument("--kind", choices=KINDS, default=None,
                   help="service manager (default: systemd on Linux, launchd on macOS)")
    s.set_defaults(func=cmd_status)
