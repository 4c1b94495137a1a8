"""``fimoe-lab lab``: open JupyterLab on the lab notebooks, private and offline-safe.

Private: the server listens on 127.0.0.1 unless ``--ip`` says otherwise, and token
authentication is always on (a random token unless ``--token`` gives one; an empty token
is refused). The token travels in the environment (``JUPYTER_TOKEN``), not on the command
line, where other users of a shared host could read it; the URL with the token is printed.

The shipped notebooks live inside the package (:func:`fimoe_lab.resources.notebooks_dir`),
which may be read-only and must not collect a user's edits: by default the lab opens a
working copy in the user's data directory (:func:`default_workspace`; notebooks already
there are kept), and a ``--dir`` inside the package or its source checkout is refused. The
same launch (:func:`jupyterlab_command`) is what the browser test runs, so the command users
type is the command that is tested.

Stopping: SIGTERM, SIGHUP and SIGINT sent to ``fimoe-lab lab`` are passed on to the JupyterLab server
(:func:`serve`), which is waited for (:data:`STOP_WAIT_S`, then terminated, then killed) before the lab's
temporary settings folder is removed and the lab exits with ``128 + signal``: nothing is left listening on the
port or on the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from fimoe_lab.errors import FimoeError
from fimoe_lab.resources import notebooks_dir

LOCAL_IP = "127.0.0.1"

# JupyterLab plugins that reach the network or nag on start; disabled for our server only
DISABLED_PLUGINS = ("@jupyterlab/apputils-extension:announcements", "@jupyterlab/extensionmanager-extension")
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
"""``--theme`` choices: JupyterLab's own theme names."""
FORWARDED = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n))
"""Signals the lab passes on to the JupyterLab server (:func:`serve`)."""
STOP_WAIT_S = 15.0
"""Seconds the server is given to stop after a forwarded signal, then again after SIGTERM, before SIGKILL."""


def port_number(text: str) -> int:
    """argparse ``type`` of ``--port``: a TCP port, an integer in 1..65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port takes a TCP port, an integer in 1..65535, got {text!r}")
    return port


def default_workspace() -> Path:
    """``$XDG_DATA_HOME/fimoe-lab/notebooks`` (default ``~/.local/share/fimoe-lab/notebooks``)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "fimoe-lab" / "notebooks"


def protected_dirs() -> list[Path]:
    """The installed package, and its source checkout when it runs from one: never a workspace."""
    package = Path(__file__).resolve().parents[1]
    dirs = [package]
    if (package.parent / "pyproject.toml").is_file():
        dirs.append(package.parent)
    return dirs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab",
        help="open JupyterLab on the lab notebooks (layout tour, checkpoint debugging, alignment tuning)",
        description="Start JupyterLab with the fimoe_lab notebooks; needs the 'lab' extra "
        "(pip install 'fimoe_lab[lab]'). It listens on 127.0.0.1 with token authentication (the URL with the token is "
        "printed). Without --dir it opens a copy of the shipped notebooks in ~/.local/share/fimoe-lab/notebooks "
        "(made on first use; your edits stay there). Ctrl-C, SIGTERM or SIGHUP stops it: the signal is passed on "
        "to JupyterLab, which is waited for, and the lab's temporary settings folder is removed.",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="notebook folder to open as it is (default: the user workspace, filled from the shipped notebooks; "
        "never the package or its checkout)",
    )
    p.add_argument("--port", type=port_number, default=None, help="TCP port, 1..65535 (default: a free one)")
    p.add_argument("--ip", default=LOCAL_IP, help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--token", default=None, help="authentication token (default: a random one); never empty")
    p.add_argument("--no-browser", action="store_true", help="do not open a web browser")
    p.add_argument(
        "--theme",
        choices=sorted(THEMES),
        default=None,
        help="JupyterLab theme for this server (default: JupyterLab's; the lab's figures follow either)",
    )
    p.set_defaults(handler=run_lab)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def working_copy(target: Path) -> Path:
    """``target`` holding every shipped notebook: the missing ones are copied in, the present ones kept."""
    target.mkdir(parents=True, exist_ok=True)
    for notebook in sorted(notebooks_dir().glob("*.ipynb")):
        if not (target / notebook.name).exists():
            shutil.copy2(notebook, target / notebook.name)
    return target


def jupyterlab_command(
    notebook_dir: Path,
    port: int,
    state_dir: Path,
    open_browser: bool = True,
    token: Optional[str] = None,
    ip: str = LOCAL_IP,
    theme: Optional[str] = None,
) -> tuple[list[str], dict]:
    """``(argv, env)`` that start JupyterLab on ``notebook_dir`` at ``ip:port`` with token authentication.

    ``env["JUPYTER_TOKEN"]`` holds the token (``token``, or a random one; an empty one is
    refused: authentication is never off). No news feed, update check or extension-manager
    queries (the network may be closed); settings and workspaces live in ``state_dir`` so
    the user's own are not touched. ``theme``: a :data:`THEMES` key written to those settings.
    """
    if token is not None and not token.strip():
        raise FimoeError("an empty --token would turn authentication off", fix="pass a non-empty token or none")
    labconfig = state_dir / "config" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(json.dumps({"disabledExtensions": {p: True for p in DISABLED_PLUGINS}}))
    if theme is not None:
        if theme not in THEMES:
            raise FimoeError(f"unknown theme {theme!r}", fix=f"choose one of {', '.join(sorted(THEMES))}")
        themes = state_dir / "settings" / "@jupyterlab" / "apputils-extension"
        themes.mkdir(parents=True, exist_ok=True)
        (themes / "themes.jupyterlab-settings").write_text(json.dumps({"theme": THEMES[theme]}))
    argv = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={notebook_dir}",
        f"--ServerApp.ip={ip}",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.open_browser={open_browser}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.user_settings_dir={state_dir / 'settings'}",
        f"--LabApp.workspaces_dir={state_dir / 'workspaces'}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--ServerApp.allow_root=True")  # containers often run as root; the token still guards it
    env = dict(os.environ)
    env["JUPYTER_TOKEN"] = token or secrets.token_hex(24)
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        filter(None, [str(state_dir / "config"), env.get("JUPYTER_CONFIG_PATH")])
    )
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return argv, env


def _notebook_dir(requested: Optional[Path]) -> Path:
    """The folder to open: ``requested`` (existing, outside :func:`protected_dirs`) or the filled workspace."""
    if requested is None:
        return working_copy(default_workspace())
    if not requested.is_dir():
        raise FimoeError(
            f"notebook folder {requested} does not exist", fix="pass an existing --dir, or none for the user workspace"
        )
    real = requested.resolve()
    for d in protected_dirs():
        if real == d or d in real.parents:
            raise FimoeError(
                f"notebook folder {requested} is inside {d} (the package or its checkout); the lab would save there",
                fix=f"pass a folder of your own, or no --dir to use {default_workspace()}",
            )
    return requested


def run_lab(args: argparse.Namespace) -> int:
    try:
        import jupyterlab  # noqa: F401
    except ModuleNotFoundError:
        raise FimoeError("JupyterLab is not installed", fix="pip install 'fimoe_lab[lab]'") from None
    notebook_dir = _notebook_dir(args.dir)
    print(f"notebooks: {notebook_dir.resolve()}", file=sys.stderr)
    if args.ip != LOCAL_IP:
        print(f"note: listening on {args.ip}: other machines can reach it (the token still guards it)", file=sys.stderr)
    port = args.port if args.port is not None else free_port()
    with tempfile.TemporaryDirectory(prefix="fimoe-lab-") as state:
        argv, env = jupyterlab_command(
            notebook_dir, port, Path(state), not args.no_browser, args.token, args.ip, args.theme
        )
        host = "127.0.0.1" if args.ip in ("0.0.0.0", "::", "") else args.ip
        print(f"open: http://{host}:{port}/lab?token={env['JUPYTER_TOKEN']}", file=sys.stderr)
        return serve(argv, env)


def serve(argv: list[str], env: dict) -> int:
    """Run the server ``argv`` until it exits: its exit status, or ``128 + signal`` when a :data:`FORWARDED`
    signal reached this process. Such a signal is passed on to the server (installed before it starts, so none
    is missed), which is then given :data:`STOP_WAIT_S` to stop, then terminated, then killed; either way it has
    exited when this returns."""
    got: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        for c in child:
            if c.poll() is None:
                c.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        child.append(subprocess.Popen(argv, env=env))
        if got:  # a signal came before the server started: it gets it now
            forward(got[0], None)
        code = _wait_stopped(child[0], got)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + got[0] if got else code


def _wait_stopped(server: subprocess.Popen, got: list[int]) -> int:
    """Wait for ``server``; once a signal was forwarded (``got``), at most :data:`STOP_WAIT_S`, then SIGTERM,
    then SIGKILL."""
    escalate = [server.terminate, server.kill]
    while True:
        try:
            return server.wait(timeout=STOP_WAIT_S if got else 0.5)
        except subprocess.TimeoutExpired:
            if got and escalate:
                escalate.pop(0)()
