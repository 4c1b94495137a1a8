"""``fimoe-lab lab`` is private: 127.0.0.1, token authentication always on (the token kept off the
command line), notebooks copied to a user workspace, never opened inside the package or checkout."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fimoe_lab.cli import build_parser, lab, main
from fimoe_lab.errors import FimoeError
from fimoe_lab.resources import notebooks_dir


def test_the_server_listens_locally_with_a_random_token_kept_off_the_command_line(tmp_path):
    argv, env = lab.jupyterlab_command(tmp_path / "nb", 8899, tmp_path / "state", open_browser=False)
    _, env2 = lab.jupyterlab_command(tmp_path / "nb", 8899, tmp_path / "state", open_browser=False)
    token = env["JUPYTER_TOKEN"]
    assert len(token) >= 32 and token != env2["JUPYTER_TOKEN"]  # random per launch
    joined = " ".join(argv)
    assert "--ServerApp.ip=127.0.0.1" in joined
    assert token not in joined and "token=" not in joined.lower()  # /proc/PID/cmdline is world-readable
    assert "disable_check_xsrf" not in joined and "password" not in joined.lower()


def test_ip_and_token_pass_through_and_an_empty_token_is_refused(tmp_path):
    argv, env = lab.jupyterlab_command(tmp_path / "nb", 1, tmp_path / "s", False, token="s3cret-token", ip="10.1.2.3")
    assert "--ServerApp.ip=10.1.2.3" in argv and env["JUPYTER_TOKEN"] == "s3cret-token"
    for empty in ("", "  "):
        with pytest.raises(FimoeError, match="authentication off"):
            lab.jupyterlab_command(tmp_path / "nb", 1, tmp_path / "s", False, token=empty)
    args = build_parser().parse_args(["lab", "--ip", "0.0.0.0", "--token", "abc", "--no-browser"])
    assert (args.ip, args.token) == ("0.0.0.0", "abc")
    assert build_parser().parse_args(["lab"]).ip == "127.0.0.1"


def test_the_default_workspace_is_the_users_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    folder = lab._notebook_dir(None)
    assert folder == tmp_path / "data" / "fimoe-lab" / "notebooks"
    shipped = sorted(p.name for p in notebooks_dir().glob("*.ipynb"))
    assert shipped and sorted(p.name for p in folder.glob("*.ipynb")) == shipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing written into the current directory


@pytest.mark.parametrize("where", ["package", "notebooks", "checkout"])
def test_a_folder_inside_the_package_or_checkout_is_refused(where, capsys):
    package = Path(lab.__file__).resolve().parents[1]
    folder = {"package": package, "notebooks": notebooks_dir(), "checkout": package.parent / "tests"}[where]
    if where == "checkout" and not (package.parent / "pyproject.toml").is_file():
        pytest.skip("installed without its checkout")
    if importlib.util.find_spec("jupyterlab") is None:
        with pytest.raises(FimoeError, match="the package or its checkout"):
            lab._notebook_dir(folder)
        return
    assert main(["lab", "--dir", str(folder), "--no-browser"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the package or its checkout" in err[0] and "(fix: " in err[0]


def test_a_running_server_refuses_requests_without_the_token(tmp_path):
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab is not installed")
    port = lab.free_port()
    (tmp_path / "nb").mkdir()
    argv, env = lab.jupyterlab_command(tmp_path / "nb", port, tmp_path / "state", open_browser=False)
    log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/contents"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (tmp_path / "log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}?token={env['JUPYTER_TOKEN']}", timeout=2) as r:
                    assert r.status == 200
                    break
            except urllib.error.HTTPError:
                raise
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        for bad in ("", "?token=wrong"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(url + bad, timeout=5)
            assert info.value.code == 403
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=20)
        log.close()


def test_theme_goes_to_the_servers_own_settings(tmp_path):
    lab.jupyterlab_command(tmp_path / "nb", 1, tmp_path / "s", False, theme="dark")
    settings = tmp_path / "s" / "settings" / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    assert settings.read_text() == '{"theme": "JupyterLab Dark"}'
    with pytest.raises(FimoeError, match="unknown theme 'sepia'"):
        lab.jupyterlab_command(tmp_path / "nb", 1, tmp_path / "s2", False, theme="sepia")
    assert build_parser().parse_args(["lab", "--theme", "light"]).theme == "light"


@pytest.mark.parametrize("port", ["99999", "0", "-1", "65536", "http", "80.5"])
def test_an_invalid_port_is_refused_in_one_line(port, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        main(["lab", "--port", port, "--dir", str(tmp_path), "--no-browser"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "1..65535" in err[0] and repr(port) in err[0]


@pytest.mark.parametrize("port", ["1", "8888", "65535"])
def test_a_port_in_range_is_taken_as_given(port):
    assert build_parser().parse_args(["lab", "--port", port]).port == int(port)
    assert build_parser().parse_args(["lab"]).port is None  # a free one, found at start


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_stops_jupyterlab_and_removes_the_temp_folder(tmp_path, signame):
    """The real command in a process of its own: once the server listens, the signal sent to fimoe-lab alone (not
    its group) stops JupyterLab (the port is free again), fimoe-lab exits 128 + signal, its temp folder is gone."""
    import signal
    import sys

    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab is not installed")
    port, temp, nb = lab.free_port(), tmp_path / "tmp", tmp_path / "nb"
    temp.mkdir()
    nb.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(Path(lab.__file__).resolve().parents[2])}
    argv = [sys.executable, "-m", "fimoe_lab", "lab", "--dir", str(nb), "--port", str(port), "--no-browser"]
    log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-2000:]
            time.sleep(0.3)
        assert [p.name for p in temp.iterdir() if p.name.startswith("fimoe-lab-")]  # its settings folder
        signum = getattr(signal, signame)
        proc.send_signal(signum)  # to fimoe-lab only: the server hears of it through the forwarding
        assert proc.wait(timeout=60) == 128 + signum, (tmp_path / "log").read_text()[-2000:]
        assert not _listening(port)
        assert not [p.name for p in temp.iterdir() if p.name.startswith("fimoe-lab-")]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        log.close()
