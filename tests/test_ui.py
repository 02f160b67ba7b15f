"""`kvshot ui` as a user runs it: every way of stopping it takes its MLflow server down; a busy port is one line."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.ui import answers

KVSHOT = str(Path(sys.executable).parent / "kvshot")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _start_ui(root: Path, port: int) -> subprocess.Popen:
    """`kvshot ui` in a workspace, until its server answers (it runs in a session of its own, as from a shell)."""
    proc = subprocess.Popen([KVSHOT, "ui", "--port", str(port), "--root", str(root)], cwd=root, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not answers(f"http://127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"kvshot ui did not come up: {proc.communicate()[0][-2000:]}")
        time.sleep(0.5)
    return proc


@pytest.mark.slow   # an MLflow server start per signal: about 15 s each
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_every_stop_signal_takes_the_server_down(tmp_path, sig):
    port = _free_port()
    proc = _start_ui(tmp_path, port)
    server = psutil.Process(proc.pid).children(recursive=True)   # the MLflow server and its web server
    assert server and _listening(port)
    try:
        proc.send_signal(sig)
        code = proc.wait(60)
        if sig != signal.SIGKILL:                 # a clean stop, not a crash
            assert code == 0, proc.stdout.read()[-2000:]
        gone, alive = psutil.wait_procs(server, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        assert not _listening(port)
    finally:
        for p in server:
            if p.is_running():
                p.kill()
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_a_busy_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([KVSHOT, "ui", "--port", str(port), "--root", str(tmp_path)], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is already in use" in lines[0], out.stderr
    assert "--port" in lines[0] and not out.stdout.strip()
