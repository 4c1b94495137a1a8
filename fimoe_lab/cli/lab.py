"""``fimoe-lab lab``: open JupyterLab on the lab notebooks, offline-safe.

The shipped notebooks live inside the package (:func:`fimoe_lab.resources.notebooks_dir`),
which may be read-only and must not collect a user's edits: by default the lab opens a
working copy in ``./fimoe-lab-notebooks`` (notebooks already there are kept). The same
launch (:func:`jupyterlab_command`) is what the browser test runs, so the command users
type is the command that is tested.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from fimoe_lab.errors import FimoeError
from fimoe_lab.resources import notebooks_dir

WORK_DIR = Path("fimoe-lab-notebooks")
"""Default working copy of the shipped notebooks, relative to the current directory."""

# JupyterLab plugins that reach the network or nag on start; disabled for our server only
DISABLED_PLUGINS = ("@jupyterlab/apputils-extension:announcements", "@jupyterlab/extensionmanager-extension")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab",
        help="open JupyterLab on the lab notebooks (layout tour, checkpoint debugging, alignment tuning)",
        description="Start JupyterLab on 127.0.0.1 with the fimoe_lab notebooks; needs the 'lab' extra "
        f"(pip install 'fimoe_lab[lab]'). Without --dir it opens ./{WORK_DIR}, a copy of the "
        "shipped notebooks (made on first use; your edits stay there). Ctrl-C stops it.",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"notebook folder to open as it is (default: ./{WORK_DIR}, filled from the shipped notebooks)",
    )
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument("--no-browser", action="store_true", help="do not open a web browser")
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
    notebook_dir: Path, port: int, state_dir: Path, open_browser: bool = True, token: str = ""
) -> tuple[list[str], dict]:
    """``(argv, env)`` that start JupyterLab on ``notebook_dir`` at ``127.0.0.1:port``.

    No news feed, update check or extension-manager queries (the network may be
    closed); settings and workspaces live in ``state_dir`` so the user's own are not
    touched; an empty ``token`` is only safe because the server listens on 127.0.0.1.
    """
    labconfig = state_dir / "config" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(json.dumps({"disabledExtensions": {p: True for p in DISABLED_PLUGINS}}))
    argv = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={notebook_dir}",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        "--ServerApp.password=",
        f"--ServerApp.open_browser={open_browser}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.user_settings_dir={state_dir / 'settings'}",
        f"--LabApp.workspaces_dir={state_dir / 'workspaces'}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--ServerApp.allow_root=True")  # containers often run as root; still 127.0.0.1 only
    env = dict(os.environ)
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        filter(None, [str(state_dir / "config"), env.get("JUPYTER_CONFIG_PATH")])
    )
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return argv, env


def run_lab(args: argparse.Namespace) -> int:
    try:
        import jupyterlab  # noqa: F401
    except ModuleNotFoundError:
        raise FimoeError("JupyterLab is not installed", fix="pip install 'fimoe_lab[lab]'") from None
    if args.dir is not None and not args.dir.is_dir():
        raise FimoeError(
            f"notebook folder {args.dir} does not exist", fix=f"pass an existing --dir, or none to open ./{WORK_DIR}"
        )
    notebook_dir = args.dir if args.dir is not None else working_copy(WORK_DIR)
    print(f"notebooks: {notebook_dir.resolve()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fimoe-lab-") as state:
        argv, env = jupyterlab_command(notebook_dir, args.port or free_port(), Path(state), not args.no_browser)
        return subprocess.call(argv, env=env)
